"""Published runs replayed in simulation: the GPipe paper's table and measured GPU steps."""
