"""A run's and a command's configuration: the typed schema that Hydra composes into (schema, commands), the rules
that types cannot express (rules), the closed choices and the registries of open ones, and every `auto` that can be
decided without torch (global_step, packing_rule). Imports nothing of torch."""
