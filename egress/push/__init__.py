"""The push job: wakes offline devices from the inbox (`job.py`) through the providers'
own APIs (`providers.py`), logging every outcome to `push_log`."""
