"""The Mixtral/Mistral architecture on one device; no process-group code lives here."""

from models.config import ConfigError, ModelConfig
from models.transformer import Transformer

__all__ = ["ConfigError", "ModelConfig", "Transformer"]
