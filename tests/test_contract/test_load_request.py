"""The load request: what the operator sends is what the engine parses."""

from __future__ import annotations

import pytest

from kubelora.contract.load import LoadRequest, S3Access
from kubelora.engine.server.protocol import parse_load_adapter


@pytest.mark.parametrize("request_", [
    LoadRequest("a", "/adapters/a"),
    LoadRequest("a", "https://h/a.tar", is_inplace=True, is_preload=False, sha256="ab" * 32, auth_token="t"),
    LoadRequest("a", "s3://team-a/a/", s3=S3Access(endpoint="http://minio:9000", region="eu-west-1",
                                                   access_key_id="AK", secret_access_key="SK", session_token="ST")),
    LoadRequest("a", "s3://team-a/a/", s3=S3Access(region="eu-west-1")),
])
def test_the_engine_parses_the_payload_back_into_the_same_request(request_):
    assert parse_load_adapter(request_.as_payload()) == request_


def test_credentials_stay_out_of_reprs_and_come_from_a_secret_only_whole():
    request = LoadRequest("a", "s3://b/a", auth_token=None, s3=S3Access(access_key_id="AK", secret_access_key="SK"))
    assert "SK" not in repr(request) and "SK" not in repr(request.s3)
    assert S3Access.from_secret_data({"AWS_ACCESS_KEY_ID": "AK"}) is None
    assert S3Access.from_secret_data({"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK",
                                      "AWS_REGION": "not a region"}) is None
    access = S3Access.from_secret_data({"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK",
                                        "AWS_ENDPOINT_URL": "http://m:9000"})
    assert access.overridden("http://n:9000", None).as_payload() == {
        "endpoint": "http://n:9000", "access_key_id": "AK", "secret_access_key": "SK"}
    with pytest.raises(ValueError, match="go together"):
        S3Access(access_key_id="AK")
