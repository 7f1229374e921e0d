"""Optional integrations with other libraries; each module imports its library lazily and is
only usable when that library is installed."""
