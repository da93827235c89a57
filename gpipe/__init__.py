"""The gpipe command: a module per subcommand, the only code wiring the three parts together."""
