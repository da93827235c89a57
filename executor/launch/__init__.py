"""Starting the ranks: the launch agent, the fork server, one rank's process and nodes."""
