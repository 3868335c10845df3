"""The training-rank base class under its upstream path; it lives in `slime.backends.train_actor`."""

from slime.backends.train_actor import TrainRayActor, get_free_port

__all__ = ["TrainRayActor", "get_free_port"]
