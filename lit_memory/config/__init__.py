"""From argv to a checked run: the trust decision (`trust`), the recipe a run saves and shares (`shared_recipe`),
the shipped recipes, expanded, and the flags that name them (`shipped`), and the option names a command knows
(`option_names`)."""
