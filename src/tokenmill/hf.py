"""``tokenmill.hf``: Hugging Face Trainer integration (an alias of ``tokenmill.integrations.hf``)."""

from tokenmill.integrations.hf import *  # noqa: F401,F403
from tokenmill.integrations.hf import __all__  # noqa: F401
