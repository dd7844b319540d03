"""Built-in protocol plugins (gleak.protocols): one module per protocol. See gleak.mechanics.protocol for the base class."""
from gleak.contracts.compat import as_installed_package

as_installed_package(__name__)
