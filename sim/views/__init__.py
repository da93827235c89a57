"""What the user sees: timeline figures, the text report and progress lines."""
