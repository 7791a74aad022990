"""What each keras_ps process imports at start: the agent and the rendezvous
need no TensorFlow; `python -m keras_ps.server` loads TF's server without
TF's Python API (a joining worker serves seconds sooner); a training program
gets keras_ps' Keras hooks as soon as it uses a keras_ps name."""

import json
import subprocess
import sys

import portpicker
import pytest

pytestmark = pytest.mark.timeout(120)


def _run(code):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_agent_and_rendezvous_do_not_import_tensorflow():
    seen = _run(
        "import json, sys\n"
        "import keras_ps, keras_ps.elastic, keras_ps.elastic.launch\n"
        "from keras_ps import cluster\n"
        "cluster.parse_tf_config('{\"cluster\": {\"ps\": [\"h:1\"], "
        "\"worker\": [\"h:2\"]}, \"task\": {\"type\": \"ps\", \"index\": 0}}')\n"
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('tensorflow', 'keras'))))\n")
    assert seen == []


_SERVE = (
    "import json, sys\n"
    "{prelude}\n"
    "from keras_ps import _tf_adapter\n"
    "server_lib, config_pb2 = _tf_adapter.server_modules()\n"
    "server = server_lib.Server(server_lib.ClusterSpec("
    "{{'worker': ['localhost:{port}']}}), job_name='worker', task_index=0, "
    "config=config_pb2.ConfigProto(), start=True)\n"
    # Read before the probe's own import (keras_ps.coordinator imports TF).
    "full_api = 'tensorflow._api.v2' in sys.modules\n"
    "from keras_ps.cluster._network import probe\n"
    "print(json.dumps({{'full_api': full_api, "
    "'answers': probe('localhost:{port}', 5.0)}}))\n")


def test_server_modules_serve_without_tensorflow_api():
    result = _run(_SERVE.format(prelude="",
                                port=portpicker.pick_unused_port()))
    assert result == {"full_api": False, "answers": True}


def test_server_modules_fall_back_to_full_import():
    # A TF whose server module cannot be loaded alone: the full import runs.
    prelude = "sys.modules['tensorflow.core.protobuf.config_pb2'] = None"
    result = _run(_SERVE.format(prelude=prelude,
                                port=portpicker.pick_unused_port()))
    assert result == {"full_api": True, "answers": True}


def test_keras_hooks_installed_on_first_use():
    seen = _run(
        "import json\n"
        "import keras_ps\n"
        "from keras_ps._keras import fit_routing, hooks\n"
        "def installed():\n"
        "    return hooks.installed(fit_routing.TRAINER_CLASS, 'fit')\n"
        "before = installed()\n"
        "keras_ps.DatasetCreator\n"
        "print(json.dumps([before, installed()]))\n")
    assert seen == [False, True]
