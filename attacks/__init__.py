"""Built-in attack plugins (gleak.attacks): one module per attack."""
from gleak.contracts.compat import as_installed_package

as_installed_package(__name__)
