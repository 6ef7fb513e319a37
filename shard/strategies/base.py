"""The shape every strategy has.

A strategy is one way of laying out or stepping a job beyond what the rules table does on its own: a
pipeline, context parallelism, gradient accumulation, ZeRO, host offload, the data-parallel reduction,
low-communication training, an average of the weights. Each is one module in shard/strategies/ with one
class below `Strategy`, listed once in `shard.strategies.ALL`. The job (shard/run/job.py), the loop
(shard/run/trainer.py), `load_model` and the plan call the methods below on every active strategy in turn
and never ask which one they hold; what a strategy does not need it leaves at the no-op default.

Order matters where strategies wrap one another: `ALL`'s order is the order in which their state is added
and their steps are wrapped (the outermost last).
"""

from typing import ClassVar


class Strategy:
    """Built from the config by `build`; every method has a default that does nothing."""

    name: ClassVar[str]                  # how the plan, the log and refusals call it
    keys: ClassVar[tuple[str, ...]] = ()  # the config keys it reads (the docs' table shows them)
    # Strategies it cannot run with, in one line each (the combination rules, as data):
    refuses: ClassVar[dict[tuple[str, str], str]] = {}  # (one of my tags, one of theirs) -> why
    switches: ClassVar[dict[str, str]] = {}  # each of its tags -> the setting that gives it (the docs' table)
    other_layouts: bool = False  # `take` reads checkpoints whose state has another shape than this job's

    @classmethod
    def build(cls, cfg, mesh_shape: dict, rules: dict, work) -> "Strategy | None":
        """The strategy cfg asks for on this mesh, checked against the model and the data (one-line
        UserError), or None where its keys leave it off."""
        raise NotImplementedError

    @property
    def label(self) -> str:
        """The setting that switched it on, as a user writes it (refusals name it)."""
        return self.name

    @property
    def tags(self) -> tuple[str, ...]:
        """What other strategies' `refuses` match: its name, and a variant where only that one clashes
        (e.g. the ring of context parallelism)."""
        return (self.name,)

    # ---- tracing the model
    def hooks(self) -> dict:
        """Keyword arguments for shard.nn.hooks.use while the steps are traced: what the model's hooks answer
        with (the pipeline's schedule, the context split)."""
        return {}

    def step_options(self, job) -> dict:
        """Fields of the train step's gradient Reduction (shard/strategies/gradients.py) and of the steps'
        arguments (`device_shardings`, `order`) this strategy decides."""
        return {}

    def reduce_once(self) -> str:
        """Why this strategy wants each device's gradient reduced once a step rather than by XLA inside the
        backward pass, said as what the latter costs ("" where it does not care)."""
        return ""

    def per_shard(self) -> str:
        """Why the step cannot run per data shard under a vmap, the once-a-step reduction's way ("" if it can)."""
        return ""

    # ---- the state
    def shardings(self, shardings, mesh):
        """The state's shardings as this strategy keeps them between steps (ZeRO's split moments, offload's
        host memory), from the rules' shardings."""
        return shardings

    def add_state(self, abstract, init, shardings, mesh):
        """State this strategy adds beside the model: (abstract, init, shardings) of the whole train state."""
        return abstract, init, shardings

    def fill(self, state):
        """`state` restored from a checkpoint that lacks this strategy's state (or freshly loaded weights):
        that state set from the model (inside a jitted program)."""
        return state

    def lacks(self, state) -> bool:
        """Whether `state` (restored) lacks what this strategy adds: then the job fills it."""
        return False

    def to_running(self, state):
        """A state in the model's own layout (restored, initialised) as the step keeps it."""
        return state

    def to_stored(self, state):
        """The step's state in the model's own layout: what checkpoints hold and what leaves the loop."""
        return state

    def model_view(self, state):
        """The model this state stands for, as eval, the end-of-run sample, load_model and export see it
        (a state of the model's own shape, no optimizer)."""
        return state

    def take(self, job, folder, step: int, resume: bool):
        """(state, meta) from a checkpoint written in another layout than this strategy's (None: read it as
        usual). `resume`: the run's own checkpoint or checkpoint.restore_from; else train.init_from."""
        return None

    @classmethod
    def read_model(cls, cfg, folder, step: int, target):
        """load_model: (state, meta) of the model a run trained with this strategy stands for, read from its
        checkpoint into `target` (the model's own shapes), or None to read the model's weights as usual."""
        return None

    # ---- the steps
    def wrap_train(self, train_fn):
        return train_fn

    def wrap_eval(self, eval_fn):
        return eval_fn

    def compile(self, abstract, shardings) -> None:
        """Compile the programs `after_step` runs (nothing by default)."""

    def after_step(self, state, done: int):
        """Run after step `done` (1-based) in the loop: the state after this strategy's own program."""
        return state

    # ---- the plan and the log
    def plan(self, job, step_ops: list, n: int) -> dict:
        """This strategy's entries in plan.json (and the report): its figures, checked against its paper."""
        return {}

    plan_keys: ClassVar[tuple[str, ...]] = ()  # the keys `plan` writes (None in plan.json when it is off)

    @staticmethod
    def report(plan: dict) -> list[str]:
        """Its lines in the plan's report, from plan.json (the keys its `plan` wrote)."""
        return []

    def trained(self, abstract):
        """What the train step differentiates and updates where it is not `abstract.params` (low-rank adapters),
        else None: the gradients' and the optimizer state's shapes."""
        return None

    def gradient_shardings(self, job):
        """Where the step keeps the gradients between microbatches, if not like the parameters (None)."""
        return None

    def wire_bytes(self, job, n: int) -> float:
        """Bytes per device and step that move outside the train step's own program (e.g. DiLoCo's syncs)."""
        return 0.0

    def idle_share(self) -> float:
        """The share of the step in which devices wait (a pipeline's bubble)."""
        return 0.0

    def notes(self) -> list[str]:
        """Lines the log warns with and the plan shows (e.g. a fallback this strategy had to take)."""
        return []


def params_copy(key: str, abstract, init, shardings):
    """(abstract, init, shardings) of the train state with a copy of the parameters in `extra[key]`, laid out
    like them and set from them at init (an average of the weights, a frozen reference)."""

    def build():
        state = init()
        return with_params_copy(key, state)

    return (abstract.replace(extra={**(abstract.extra or {}), key: abstract.params}), build,
            shardings.replace(extra={**(shardings.extra or {}), key: shardings.params}))


def with_params_copy(key: str, state):
    """`state` with its parameters copied into `extra[key]`."""
    return state.replace(extra={**(state.extra or {}), key: state.params})


def mb(n) -> str:
    """Bytes as the plan prints them."""
    return f"{n / 2**20:.2f} MiB" if n is not None else "?"
