"""Delta tables on an S3-compatible object store: what delta-rs needs to commit there safely.

A Delta commit is "create `_delta_log/<version>.json` unless it exists". A local file system
gives that atomically (link, rename-noreplace); S3 only with a conditional PUT
(`If-None-Match: *`, which S3 and most S3-compatible servers support), or with a lock
provider (DynamoDB). The options below always ask delta-rs for conditional put, explicitly:
two writers can then never both commit one version (tests/test_object_store.py races two
processes). delta-rs 1.6 also won that race on moto without the option, but object_store
documents conditional put as off unless requested, and we do not rely on a default.

Credentials come from the environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, and
`AWS_SESSION_TOKEN` if set), never from a settings file, and are not part of any repr.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


@dataclass(frozen=True)
class S3Location:
    endpoint: str = ""          # empty: AWS's own; else e.g. http://127.0.0.1:9000
    region: str = "us-east-1"

    def storage_options(self) -> dict[str, str]:
        """delta-rs `storage_options` (object_store's S3 keys), credentials from the
        environment."""
        opts = {"AWS_REGION": self.region, "conditional_put": "etag"}
        if self.endpoint:
            opts["AWS_ENDPOINT_URL"] = self.endpoint
            if self.endpoint.startswith("http://"):
                opts["AWS_ALLOW_HTTP"] = "true"
        for var in CREDENTIAL_VARS:
            if os.environ.get(var):
                opts[var] = os.environ[var]
        return opts
