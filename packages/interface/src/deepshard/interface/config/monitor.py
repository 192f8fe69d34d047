"""`tensorboard`, `wandb`, `csv_monitor`, `comet`: where training metrics are reported."""

from __future__ import annotations

from pydantic import Field

from deepshard.interface.config._base import ConfigModel

__all__ = ["CometConfig", "CsvMonitorConfig", "TensorBoardConfig", "WandbConfig"]


class TensorBoardConfig(ConfigModel):
    """The `tensorboard` section (needs the ``tensorboard`` package when enabled)."""

    config_key = "tensorboard"
    drops_auto = True

    enabled: bool = False
    """Write scalars (loss, learning rate, loss scale, ...) as TensorBoard events."""

    output_path: str = ""
    """Directory for the event files; empty means the launch directory."""

    job_name: str = "DeepShardJobName"
    """Sub-directory of ``output_path`` for this run. Deliberate deviation: DeepSpeed's default
    is ``"DeepSpeedJobName"``."""


class WandbConfig(ConfigModel):
    """The `wandb` section (needs the ``wandb`` package when enabled)."""

    config_key = "wandb"
    drops_auto = True

    enabled: bool = False
    """Log scalars to Weights & Biases."""

    group: str | None = None
    """W&B group to put this run in."""

    team: str | None = None
    """W&B team (entity)."""

    project: str = "deepshard"
    """W&B project. Deliberate deviation: DeepSpeed's default is ``"deepspeed"``."""


class CsvMonitorConfig(ConfigModel):
    """The `csv_monitor` section: scalars appended to local CSV files."""

    config_key = "csv_monitor"
    drops_auto = True

    enabled: bool = False
    """Write one CSV file per logged scalar."""

    output_path: str = ""
    """Directory for the CSV files; empty means the launch directory."""

    job_name: str = "DeepShardJobName"
    """Sub-directory of ``output_path`` for this run. Deliberate deviation: DeepSpeed's default
    is ``"DeepSpeedJobName"``."""


class CometConfig(ConfigModel):
    """The `comet` section (needs the ``comet_ml`` package when enabled)."""

    config_key = "comet"
    drops_auto = True

    enabled: bool = False
    """Log scalars to a Comet experiment."""

    samples_log_interval: int = Field(100, ge=1)
    """Send metrics every this many samples. Deliberate deviation: DeepSpeed sets no bound, but
    an interval below 1 cannot schedule any send, so DeepShard refuses it."""

    project: str | None = None
    """Comet project; None falls back to Comet's own configuration (COMET_PROJECT_NAME)."""

    workspace: str | None = None
    """Comet workspace; None falls back to COMET_WORKSPACE."""

    api_key: str | None = None
    """Comet API key; None falls back to COMET_API_KEY (prefer the environment)."""

    experiment_name: str | None = None
    """Name of the experiment."""

    experiment_key: str | None = None
    """Key of an existing experiment to continue (32-50 alphanumeric characters)."""

    online: bool | None = None
    """Log to the Comet server (true) or to an offline archive (false); None means online."""

    mode: str | None = None
    """How the experiment starts: "get", "create" or "get_or_create" (Comet's default)."""
