"""What the tests share: commands run in-process, sample models, synthetic costs and tiny scenarios."""
