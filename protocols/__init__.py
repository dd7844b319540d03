"""Built-in protocol plugins (gleak.protocols): one module per protocol. See gleak.protocol for the base class."""
