# Sourced by scripts/run.sh and scripts/test.sh: `venv_install EXTRAS` creates .venv if missing and installs
# moe_comm (editable) with EXTRAS. torch is pinned and installed first: the CPU wheel for Python 3.11 lies on
# the CI machines' disk, and an unpinned resolve would download several GB of CUDA wheels.
venv_install() {
    if [ ! -x .venv/bin/python ]; then
        "${PYTHON:-python3}" -m venv .venv
    fi
    .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
    .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[$1]"
}
