"""`python -m shard.eval`: lm-evaluation-harness's tasks on a run; the code lives in shard/use/evaluate.py (the
command) and shard/use/lm_eval_model.py (the run's model as lm_eval's model)."""

from shard.cli import command
from shard.use.evaluate import main

command(__name__, main)
