"""``tokenmill.torch``: the torch integration (an alias of ``tokenmill.integrations.torch``)."""

from tokenmill.integrations.torch import *  # noqa: F401,F403
from tokenmill.integrations.torch import __all__  # noqa: F401
