"""From argv to a checked run: the trust decision (`trust`), recipes expanded and saved (`recipes`), the shipped
recipes and the flags that name them (`shipped`), and the option names a command knows (`option_names`)."""
