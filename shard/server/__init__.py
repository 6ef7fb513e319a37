"""The server behind `python -m shard.serve RUN` (shard/serve.py): an OpenAI-compatible HTTP server over a
trained run, with continuous batching.

engine.py: the slots' cache and the compiled prefill, insert and step; scheduler.py: the queue and the slots;
protocol.py: the request and response shapes; chat.py: messages to a prompt; app.py: the routes; cli.py: the
command line. Their log lines go to the logger "shard.serve", the command's name."""
