"""The error every configuration check raises (`mbd.config` re-exports it, the name its users import). A module
of its own so that the checks `mbd.config` calls (`mbd.hf_keys`) can raise it without importing `mbd.config`."""


class ConfigError(ValueError):
    """A configuration file or value is invalid; the message names the field and the fix."""
