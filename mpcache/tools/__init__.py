"""Command-line tools that read what a running or finished service left: ``logtail`` (mpcache-logs) and
``report`` (mpcache-report)."""
