"""swarmctl: pool friends' machines to run one large language model."""

__version__ = "0.1.0"
