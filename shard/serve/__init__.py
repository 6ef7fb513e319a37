"""`python -m shard.serve RUN`: an OpenAI-compatible HTTP server over a trained run, with continuous batching.

engine.py: the slots' cache and the compiled prefill, insert and step; scheduler.py: the queue and the slots;
protocol.py: the request and response shapes; chat.py: messages to a prompt; app.py: the routes; cli.py: the
command line."""


def main(argv: list[str]) -> int:
    """The command line (imported on use: `import shard.serve` stays light)."""
    from shard.serve.cli import main as run

    return run(argv)
