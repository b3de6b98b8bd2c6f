"""Configuration: dataclass sections (`job_config.py`), TOML/CLI loading (`manager.py`), and the run's steps and
intervals given in epochs (`epochs.py`)."""

from titan_contrastive.config.epochs import run_steps
from titan_contrastive.config.job_config import JobConfig
from titan_contrastive.config.manager import ConfigError, parse_args

__all__ = ["ConfigError", "JobConfig", "parse_args", "run_steps"]
