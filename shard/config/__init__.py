"""The config: one typed `Config` per job, from a YAML file plus `key=value` overrides.

One module per job: `schema` defines every key once (type, default, help, allowed values); `loading`
reads, checks and merges YAML and overrides into a Config; `naming` picks the run folder from what a job
trains; `help` lays out `--help`. The names the rest of the project uses are re-exported here, so
`from shard import config` and `config.load(...)` are all a caller needs.
"""

from shard.config.help import USAGE, help_text
from shard.config.loading import load, shown_path, step_range, to_yaml
from shard.config.loading import _read_yaml  # private: tests read a shipped config file's own values with it
from shard.config.naming import (CONFIGS, JOB_KEYS, JOB_SECTIONS, NOT_JOB, RUNS, default_run_dir, job_key,
                                 job_keys_outside_sections, job_values, not_job_keys_inside_sections)
from shard.config.schema import (FREE_FORM, SECTIONS, CheckpointConfig, Config, DataConfig, MeshConfig,
                                 ModelConfig, OptimizerConfig, PipelineConfig, RunConfig, TrainConfig, key_of,
                                 keys_of, option, schema_fields, to_dict, type_name)
