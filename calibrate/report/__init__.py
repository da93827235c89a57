"""The run report: predicted against measured, as a picture and an HTML page."""
