"""Configuration: dataclass sections (`job_config.py`) and TOML/CLI loading (`manager.py`)."""

from titan_contrastive.config.job_config import JobConfig
from titan_contrastive.config.manager import ConfigError, parse_args

__all__ = ["ConfigError", "JobConfig", "parse_args"]
