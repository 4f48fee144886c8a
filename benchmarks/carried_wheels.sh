# Sourced by the H200 scripts: installs the wheels carried in .whl/ (torchtitan 0.2.2 for SimpleFSDP,
# --no-deps; see the device README) into /tmp/site and puts it on PYTHONPATH. Nothing without .whl/.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
