"""A Batches API completion_window that is not a sane duration (inf, 1e400, 1e308, nan) is a
400 invalid_request_error naming the field, not a 500 (conftest's batch manager on a file
store, no engine)."""

import pytest

from batchrun.openai.bodies import error_body
from batchrun.server.errors import APIError
from tests.server.conftest import upload_line


@pytest.mark.parametrize("window", ["inf", "1e400", "1e308", "nan", "-1", "999999999999h"])
def test_an_absurd_completion_window_is_a_400(manager, window):
    f = upload_line(manager)
    with pytest.raises(APIError) as e:
        manager.create({"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                        "completion_window": window})
    assert e.value.status_code == 400 and e.value.param == "completion_window"
    assert error_body(e.value)["error"]["type"] == "invalid_request_error"
    assert window in e.value.message
    ok = manager.create({"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                         "completion_window": "24h"})
    assert ok["expires_at"] - ok["created_at"] == 86400
