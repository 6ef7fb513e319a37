"""The core a job is built from: the mesh, the model registry, the train state and its shardings, the step,
losses and the optimizer."""
