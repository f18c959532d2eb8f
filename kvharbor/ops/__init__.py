"""Operating kvharbor: the logic behind ``kvharbor status`` and ``kvharbor doctor``."""
