"""A run's and a command's configuration, without torch: the typed schema Hydra composes into (schema, commands), the
rules that types cannot express (rules), the closed choices and the registries of open ones (choices),
and every `auto` with the batch-size arithmetic (auto). May import: io, errors."""
