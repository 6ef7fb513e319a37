"""Host offload (`train.offload=optimizer|params`): that part of the state lives in pinned host memory between
steps and is moved to the device inside the step (the step's in and out shardings say where)."""

from shard.core import state as state_lib
from shard.strategies.base import Strategy


class Offload(Strategy):
    name = "offload"
    keys = ("train.offload",)
    switches = {"offload": "`train.offload=optimizer` or `params`"}

    def __init__(self, what: str):
        self.what = what

    @classmethod
    def build(cls, cfg, mesh_shape, rules, work):
        return None if cfg.train.offload == "none" else cls(cfg.train.offload)

    @property
    def label(self) -> str:
        return f"train.offload={self.what}"

    def shardings(self, shardings, place):
        state_lib.check_offload(self.what, place.mesh.devices.flat[0])
        return state_lib.host_shardings(shardings, self.what)

    def step_options(self, place) -> dict:
        return {"device_shardings": place.device_shardings}  # what each step moves in
