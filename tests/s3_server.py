"""A real S3 API for the object-storage tests: moto's server on 127.0.0.1, on a free port, one per test
session (the `s3` fixture in conftest.py), stopped at its end.

The tests talk to it the way users talk to S3: through the environment botocore and s3fs read
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...), so the code under test configures nothing of its own.
"""

from __future__ import annotations

import json
import socket
import urllib.request
import uuid
from dataclasses import dataclass

# Credentials moto accepts while it does not enforce authentication (its default).
TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # one attempt: an unreachable endpoint is reported at once, not after botocore's retries
    "AWS_MAX_ATTEMPTS": "1",
}


@dataclass
class S3Server:
    """The running server: its endpoint, a boto3 client for setting up buckets, and helpers."""

    endpoint: str
    client: object

    def bucket(self, prefix: str = "b") -> str:
        """A new, empty bucket with a unique name."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=name)
        return name

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=bucket, Key=key, Body=data)

    def user_of_one_bucket(self, bucket: str, name: str) -> dict[str, str]:
        """An IAM user allowed everything on `bucket` and nothing else: the environment (its access key)
        that signs requests as that user once `enforce_auth(True)`. moto names a listing's action
        s3:ListObjectsV2 where AWS says s3:ListBucket, so the policy allows s3:* on the one bucket."""
        import boto3

        iam = boto3.client("iam", endpoint_url=self.endpoint, region_name="us-east-1")
        user = f"{name}-{bucket}"
        iam.create_user(UserName=user)
        statement = {"Effect": "Allow", "Action": "s3:*",
                     "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]}  # fmt: skip
        policy = {"Version": "2012-10-17", "Statement": [statement]}
        iam.put_user_policy(UserName=user, PolicyName="one-bucket", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}

    def enforce_auth(self, on: bool) -> None:
        """Turn moto's IAM enforcement on (every request from now on must be signed by a user it knows,
        and is allowed only what that user's policies allow) or off (its default)."""
        body = b"0" if on else b"inf"
        req = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth",
            data=body,
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200


def unreachable_endpoint() -> str:
    """An endpoint URL on 127.0.0.1 that nothing listens on (a port just bound and closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
