//! The kernels: embedded CUDA sources compiled by NVRTC once per device, for
//! that device's own architecture.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{CompileError, CompileOptions};

use super::kernel_prelude::kernel_prelude;
use crate::base::error::{err, Result};

/// Shared descriptors, prepended to every kernel source.
const DESCRIPTORS: &str = include_str!("../../../kernels/descriptors.cuh");
/// The checksum kernel.
const CHECKSUM: &str = include_str!("../../../kernels/checksum.cu");
/// The stored-checksum kernel (SPEC section 8), in the same module.
const STORED: &str = include_str!("../../../kernels/stored.cu");
/// The state kernel (uses helpers of the checksum kernel's source).
const STATE: &str = include_str!("../../../kernels/state.cu");

/// What NVRTC compiles: the generated constants, the descriptors and their
/// generated layout checks, then the kernels (one module).
fn checksum_source() -> String {
    [
        kernel_prelude(DESCRIPTORS).as_str(),
        CHECKSUM,
        "\n",
        STORED,
        "\n",
        STATE,
    ]
    .concat()
}

/// A compiled module and the entry points taken from it.
pub struct Kernels {
    /// Keeps the functions' module loaded.
    _module: Arc<CudaModule>,
    /// `kvcs_checksum`.
    pub checksum: CudaFunction,
    /// `kvcs_checksum_unpaired`: the same for calls with no layer whose two
    /// segments read alike (fewer registers).
    pub checksum_unpaired: CudaFunction,
    /// `kvcs_checksum_single_head`: the same for calls whose layers all hold
    /// one head (more loads in flight per lane).
    pub checksum_single_head: CudaFunction,
    /// `kvcs_checksum_placed`: the same for calls with a layer whose tokens
    /// are spread over DCP ranks (SPEC section 16).
    pub checksum_placed: CudaFunction,
    /// `kvcs_checksum_narrow`: the same for calls that read a layer of
    /// 4-byte pieces (SPEC section 1).
    pub checksum_narrow: CudaFunction,
    /// `kvcs_store`.
    pub store: CudaFunction,
    /// `kvcs_state`.
    pub state: CudaFunction,
}

/// Compiled modules by device ordinal; filled once per device.
static KERNELS: OnceLock<Mutex<HashMap<usize, Arc<Kernels>>>> = OnceLock::new();

/// The kernels of `context`'s device, compiled on first use.
pub fn kernels(context: &Arc<CudaContext>) -> Result<Arc<Kernels>> {
    let ordinal = context.ordinal();
    let cache = KERNELS.get_or_init(Default::default);
    let mut cache = cache
        .lock()
        .map_err(|_| err!(Internal, "the kernel cache lock is poisoned"))?;
    if let Some(kernels) = cache.get(&ordinal) {
        return Ok(kernels.clone());
    }
    let module = compile(context, &checksum_source(), "kvcsum_checksum.cu")?;
    let checksum = module
        .load_function("kvcs_checksum")
        .map_err(|e| err!(Device, "device {ordinal}: loading kvcs_checksum failed: {e}"))?;
    let checksum_unpaired = module
        .load_function("kvcs_checksum_unpaired")
        .map_err(|e| err!(Device, "device {ordinal}: loading kvcs_checksum_unpaired failed: {e}"))?;
    let checksum_single_head = module.load_function("kvcs_checksum_single_head").map_err(|e| {
        err!(
            Device,
            "device {ordinal}: loading kvcs_checksum_single_head failed: {e}"
        )
    })?;
    let checksum_placed = module
        .load_function("kvcs_checksum_placed")
        .map_err(|e| err!(Device, "device {ordinal}: loading kvcs_checksum_placed failed: {e}"))?;
    let checksum_narrow = module
        .load_function("kvcs_checksum_narrow")
        .map_err(|e| err!(Device, "device {ordinal}: loading kvcs_checksum_narrow failed: {e}"))?;
    let store = module
        .load_function("kvcs_store")
        .map_err(|e| err!(Device, "device {ordinal}: loading kvcs_store failed: {e}"))?;
    let state = module
        .load_function("kvcs_state")
        .map_err(|e| err!(Device, "device {ordinal}: loading kvcs_state failed: {e}"))?;
    let kernels = Arc::new(Kernels {
        _module: module,
        checksum,
        checksum_unpaired,
        checksum_single_head,
        checksum_placed,
        checksum_narrow,
        store,
        state,
    });
    cache.insert(ordinal, kernels.clone());
    Ok(kernels)
}

/// Compiles `source` for `context`'s device and loads it. NVRTC's log goes
/// into the error (and so into `kvcs_last_error`).
pub fn compile(context: &Arc<CudaContext>, source: &str, name: &str) -> Result<Arc<CudaModule>> {
    let ordinal = context.ordinal();
    let (major, minor) = context
        .compute_capability()
        .map_err(|e| err!(Device, "device {ordinal}: reading the compute capability failed: {e}"))?;
    let ptx = nvrtc(source, name, &format!("sm_{major}{minor}"))
        .map_err(|message| err!(Device, "device {ordinal}: {message}"))?;
    context
        .load_module(ptx)
        .map_err(|e| err!(Device, "device {ordinal}: loading {name} failed: {e}"))
}

/// The kernels' PTX (`kvcs_checksum` and `kvcs_state`) for `arch` (`"sm_90"`, say), compiled by NVRTC
/// without a device: lets a machine with NVRTC but no GPU check the kernels.
pub fn checksum_ptx(arch: &str) -> Result<String> {
    if !super::raw::nvrtc_present() {
        return Err(err!(Device, "NVRTC (libnvrtc) cannot be loaded on this machine"));
    }
    let ptx = nvrtc(&checksum_source(), "kvcsum_checksum.cu", arch).map_err(|m| err!(Device, "{m}"))?;
    Ok(ptx.to_src())
}

/// Runs NVRTC on `source` for `arch`; the error carries NVRTC's log.
/// `KVCSUM_NVRTC_OPTIONS` (whitespace-separated, e.g. `-DKVCS_BATCH=8`) adds
/// options, for tuning experiments.
fn nvrtc(source: &str, name: &str, arch: &str) -> std::result::Result<cudarc::nvrtc::Ptx, String> {
    let mut extra: Vec<String> = std::env::var("KVCSUM_NVRTC_OPTIONS")
        .map(|v| v.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default();
    let mut all = vec![format!("--gpu-architecture={arch}"), "--std=c++17".to_owned()];
    all.append(&mut extra);
    let options = CompileOptions {
        options: all,
        name: Some(name.to_owned()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(source, options).map_err(|e| match e {
        CompileError::CompileError { log, options, .. } => {
            format!(
                "NVRTC failed to compile {name} with {options:?}:\n{}",
                log.to_string_lossy()
            )
        }
        other => format!("NVRTC failed on {name}: {other}"),
    })
}
