"""python -m shard.eval: lm-evaluation-harness's tasks on a run, against lm_eval's own `hf` model (transformers) on
the run's Hugging Face export, per item: a multiple-choice task, a generation task and a rolling log-likelihood
task, written offline (tests/tiny_tasks.py: local JSON Lines, no hub), on a tiny run with a real (tiny) tokenizer."""

import json

import numpy as np
import pytest

import tiny_tasks
import tiny_tokenizers
from shard.errors import UserError

tiny_tasks.offline()
lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

TASKS = list(tiny_tasks.TASKS)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The run (trained on tests/tiny_tokenizers.py's corpus through a byte-level BPE with BOS and EOS; a context
    that holds every task's prompts), its export, the tasks' folder, and lm_eval's hf model's samples on the export
    (the reference)."""
    from shard.use import evaluate, export

    tmp = tmp_path_factory.mktemp("eval")
    run = tiny_tokenizers.trained(tiny_tokenizers.make("json", tmp / "tok"), tmp, "optimizer.lr=1e-2",
                                  "model.max_len=128", steps=200)
    assert export.main([str(run), "--format", "hf", "--out", str(tmp / "hf")]) == 0
    tasks = tiny_tasks.write(tmp / "tasks")
    manager = evaluate.task_manager(TASKS, str(tasks))  # the one the command builds for this folder
    theirs = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={tmp / 'hf'},dtype=float32,device=cpu",
                                     tasks=TASKS, task_manager=manager, log_samples=True, batch_size=1,
                                     bootstrap_iters=0)
    return {"run": run, "hf": tmp / "hf", "tasks": tasks, "theirs": theirs, "tmp": tmp, "manager": manager}


def responses(samples: dict) -> dict:
    """task -> each document's filtered responses, by doc_id."""
    return {task: {s["doc_id"]: s["filtered_resps"] for s in rows} for task, rows in samples.items()}


def written_samples(output) -> dict:
    """task -> its samples, from the files lm_eval's tracker wrote under `output`."""
    out = {}
    for path in output.rglob("samples_*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        out[path.name.removeprefix("samples_").rsplit("_", 1)[0]] = rows
    return out


def assert_agree(ours: dict, theirs: dict, tasks=TASKS) -> None:
    """Per item: log-likelihoods within 1e-4, the same greedy flags and generations."""
    for task in tasks:
        assert sorted(ours[task]) == sorted(theirs[task]), task
        for doc, want in theirs[task].items():
            got = ours[task][doc]
            if task == "tiny_gen":
                assert got == want, (task, doc)
            elif task == "tiny_roll":
                assert float(got[0]) == pytest.approx(float(want[0]), abs=1e-4), (task, doc)
            else:
                np.testing.assert_allclose([float(g[0]) for g in got], [float(w[0]) for w in want], atol=1e-4)
                assert [str(g[1]) for g in got] == [str(w[1]) for w in want], (task, doc)  # the files hold text


def test_shard_eval_scores_each_item_as_lm_evals_hf_model_on_the_export(made, capsys):
    """The command on the run, batched: results and samples written as lm_eval writes them, and every item's
    log-likelihood, greedy flag and generation equal to lm_eval's hf model's on the export; the same metrics."""
    from shard.use import evaluate

    out = made["tmp"] / "results"
    assert evaluate.main([str(made["run"]), "--tasks", ",".join(TASKS), "--include_path", str(made["tasks"]),
                          "--batch_size", "4", "--log_samples", "--output_path", str(out),
                          "--bootstrap_iters", "0"]) == 0
    printed = capsys.readouterr().out
    assert "tiny_mc" in printed and "acc" in printed and "word_perplexity" in printed
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = written_samples(out)
    assert sorted(samples) == sorted(TASKS) and all(len(rows) == 12 for rows in samples.values())
    assert_agree(responses(samples), responses(made["theirs"]["samples"]))
    for task in TASKS:
        for metric, value in made["theirs"]["results"][task].items():
            if isinstance(value, float) and "stderr" not in metric:
                assert results["results"][task][metric] == pytest.approx(value, rel=1e-4, abs=1e-6), (task, metric)
    generated = [s["filtered_resps"][0] for s in samples["tiny_gen"]]  # cut at a stop string, some not at once
    assert set(generated) == {" 4", " 4 "}


def test_on_a_mesh_one_item_at_a_time_the_answers_are_the_same(made):
    """Laid over fsdp on 4 devices, one sequence a pass: the same per-item answers (a few)."""
    from shard.use import evaluate, generate, load

    loaded = load.load(str(made["run"]), ["mesh=fsdp", "run.cpu_devices=4"], key="RUN")
    assert loaded.mesh.shape["fsdp"] == 4
    tok = load.load_tokenizer(str(made["run"]))
    lm = evaluate.model_of(loaded.model, generate.Generator(loaded.model, loaded.mesh, loaded.rules), tok, batch_size=1)
    tasks = ["tiny_mc", "tiny_gen"]
    ours = evaluate.evaluate(lm, tasks, evaluate.task_manager(tasks, str(made["tasks"])), limit=4, log_samples=True,
                             bootstrap_iters=0)
    theirs = {task: {d: r for d, r in rows.items() if d < 4}
              for task, rows in responses(made["theirs"]["samples"]).items() if task in tasks}
    assert_agree(responses(ours["samples"]), theirs, tasks)


def test_gen_kwargs_override_the_tasks_generation_settings(made):
    """--gen_kwargs max_gen_toks=1: each generation is one token, the start of the hf model's longer one."""
    from shard.use import evaluate, generate, load

    loaded = load.load(str(made["run"]), [], whole_mesh=False, key="RUN")
    tok = load.load_tokenizer(str(made["run"]))
    lm = evaluate.model_of(loaded.model, generate.Generator(loaded.model), tok, batch_size=4)
    ours = evaluate.evaluate(lm, ["tiny_gen"], made["manager"], limit=4, log_samples=True, bootstrap_iters=0,
                             gen_kwargs="max_gen_toks=1")
    full = responses(made["theirs"]["samples"])["tiny_gen"]
    for doc, (text,) in responses(ours["samples"])["tiny_gen"].items():
        assert len(tok.encode(text, special=False)) == 1 and full[doc][0].startswith(text), (doc, text)


CHAT = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def test_apply_chat_template_renders_each_prompt_as_the_hf_model_does(made, tmp_path):
    """--apply_chat_template with one few-shot example (a turn of its own): per item as lm_eval's hf model on the
    export of a run whose tokenizer has a chat template."""
    from shard.use import evaluate, export

    tok = tmp_path / "tok"
    tok.mkdir()
    for f in (made["tmp"] / "tok").iterdir():
        (tok / f.name).write_bytes(f.read_bytes())
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT}))
    run = tiny_tokenizers.trained(tok, tmp_path, "model.max_len=128", steps=1)
    assert export.main([str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    tasks = ["tiny_mc", "tiny_gen"]
    theirs = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={tmp_path / 'hf'},dtype=float32,device=cpu",
                                     tasks=tasks, task_manager=made["manager"], log_samples=True, batch_size=2,
                                     bootstrap_iters=0, limit=3, num_fewshot=1, apply_chat_template=True)
    out = tmp_path / "results"
    assert evaluate.main([str(run), "--tasks", ",".join(tasks), "--include_path", str(made["tasks"]), "--limit", "3",
                          "--num_fewshot", "1", "--apply_chat_template", "--batch_size", "2", "--log_samples",
                          "--output_path", str(out), "--bootstrap_iters", "0"]) == 0
    ours = written_samples(out)
    prompt = ours["tiny_mc"][0]["arguments"]["gen_args_0"]["arg_0"]
    assert prompt.startswith("<s>user\n") and prompt.count("<s>assistant\n") == 2, prompt
    assert_agree(responses(ours), responses(theirs["samples"]), tasks)


def test_local_completions_against_the_server_scores_each_item_as_the_hf_model(made, tmp_path):
    """lm_eval's local-completions client (token-id prompts, echo, logprobs, 4 prompts a request) against
    python -m shard.serve on the run: the same per-item answers as lm_eval's hf model on the export."""
    from test_serve import serving

    server, url = serving(made["run"], tmp_path / "serve.log", "--slots", "4")
    try:
        args = (f"model=run,base_url={url}/v1/completions,tokenizer={made['hf']},"
                "tokenizer_backend=huggingface,tokenized_requests=True,add_bos_token=True")
        theirs = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=TASKS, log_samples=True,
                                         task_manager=made["manager"], batch_size=4, bootstrap_iters=0)
    finally:
        server.kill()
        server.wait()
    assert_agree(responses(theirs["samples"]), responses(made["theirs"]["samples"]))


@pytest.mark.parametrize("argv, says", [
    (["--tasks", "no_such_task"], "--tasks: unknown task no_such_task"),
    (["--tasks", "tiny_mc", "--batch_size", "0"], "--batch_size 0: must be at least 1"),
    (["--tasks", "tiny_mc", "--log_samples"], "--log_samples needs --output_path"),
    (["--tasks", "tiny_mc", "--include_path", "/nonexistent"], "not a folder of task YAML files"),
    (["--limit", "2"], "the following arguments are required: --tasks"),
])
def test_a_mistake_is_one_line_and_exit_2(made, argv, says, capsys):
    from shard.errors import exit_from
    from shard.use import evaluate

    if "--include_path" not in argv:
        argv = [*argv, "--include_path", str(made["tasks"])]
    with pytest.raises(SystemExit) as e:
        exit_from(evaluate.main, [str(made["run"]), *argv])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and says in err, err


def test_in_training_the_tasks_metrics_land_in_metrics_jsonl_at_the_steps_asked_under_fsdp(made, tmp_path):
    """train.lm_eval on fsdp over 4 devices: lm_eval/<task>/<metric> records at steps 2 and 4 (every 2, and the
    end), the last equal to python -m shard.eval's on the saved run (one device, another path to the weights)."""
    from shard.observe import board
    from shard.use import evaluate, generate, load

    tasks = tiny_tasks.write(tmp_path / "tasks", n=4)
    run = tiny_tokenizers.trained(made["tmp"] / "tok", tmp_path, "model.max_len=128", "mesh=fsdp",
                                  "run.cpu_devices=4", "train.lm_eval.tasks=[tiny_mc]",
                                  "train.lm_eval.every=2", f"train.lm_eval.include_path={tasks}",
                                  "train.lm_eval.batch_size=4", steps=4)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scored = {r["step"]: r for r in records if "lm_eval/tiny_mc/acc" in r}
    assert sorted(scored) == [2, 4]
    assert "lm_eval/tiny_mc/acc_norm" in scored[4] and board.tag("lm_eval/tiny_mc/acc") == "lm_eval/tiny_mc/acc"
    loaded = load.load(str(run), [], whole_mesh=False, key="RUN")
    lm = evaluate.model_of(loaded.model, generate.Generator(loaded.model), load.load_tokenizer(str(run)), 1)
    again = evaluate.metrics(evaluate.evaluate(lm, ["tiny_mc"],
                                               evaluate.task_manager(["tiny_mc"], str(tasks)), bootstrap_iters=0))
    for key, value in again.items():
        assert scored[4][key] == pytest.approx(value, rel=1e-4), key


def test_in_training_an_unknown_task_is_refused_before_anything_is_written(made, tmp_path):
    from shard import config
    from shard.run import trainer

    from conftest import overrides

    cfg = config.load(None, overrides(tmp_path / "run", *tiny_tokenizers.LLAMA_SHAPED, "data.name=documents",
                                      f"data.path={made['tmp'] / 'corpus.jsonl'}",
                                      f"data.tokenizer={made['tmp'] / 'tok'}", "data.seq_len=16", "data.batch_size=4",
                                      "train.steps=1", "run.cpu_devices=1", "train.lm_eval.tasks=[nope]",
                                      f"train.lm_eval.include_path={made['tasks']}"))
    with pytest.raises(UserError, match="train.lm_eval.tasks: unknown task nope"):
        trainer.run(cfg)
    assert not (tmp_path / "run").exists()
