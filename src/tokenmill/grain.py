"""``tokenmill.grain``: the grain integration (an alias of ``tokenmill.integrations.grain``)."""

from tokenmill.integrations.grain import *  # noqa: F401,F403
from tokenmill.integrations.grain import __all__  # noqa: F401
