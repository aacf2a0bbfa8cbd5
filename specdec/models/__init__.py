"""Finding, installing, converting, calibrating and caching models (no compute: see specdec.runtime)."""
