"""Built-in defense plugins (gleak.defenses): one module per defense."""
from gleak.contracts.compat import as_installed_package

as_installed_package(__name__)
