"""Using a trained model: load it, generate from it, export it."""
