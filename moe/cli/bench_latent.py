"""The latent-attention bench's command line (`moe.bench.latent`)."""

from moe.bench.latent import run

__all__ = ["run"]
