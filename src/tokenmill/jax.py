"""``tokenmill.jax``: the jax integration (an alias of ``tokenmill.integrations.jax``)."""

from tokenmill.integrations.jax import *  # noqa: F401,F403
from tokenmill.integrations.jax import __all__  # noqa: F401
