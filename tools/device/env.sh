# Sourced by the device scripts (session.sh, graphs.sh, k3graphs.sh, tpdecode.sh) once P (the prebuilt
# directory of prebuild.sh) and OUT (the folder that comes back) are set: the environment every call
# needs, and T, the summary file, with step() to mark its sections.
# NVLink multicast stays off (the device README: it can take shared GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# lunar links libnccl.so.2: the device has it in PyTorch's nvidia-nccl wheel, not in the toolkit
NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2> /dev/null)
export LD_LIBRARY_PATH="$P/lib${NCCL_DIR:+:$NCCL_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
mkdir -p "$OUT"
T=$OUT/${SUMMARY:-summary.txt}
: > "$T"
t0=$(date +%s)
step() { echo "== $1 (t = $(( $(date +%s) - t0 )) s)" | tee -a "$T"; }
