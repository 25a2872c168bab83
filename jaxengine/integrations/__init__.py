"""jaxengine inside other frameworks (each module imports its framework; install its extra)."""
