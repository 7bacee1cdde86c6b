//! The device engine over cudarc (driver API, NVRTC, both loaded at run time).
//!
//! cudarc panics when it cannot load `libcuda` or `libnvrtc`, so presence is
//! checked first and absence becomes `Error::Device`.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::error::{err, Result};
use crate::layout::{Layout, Role};
use crate::plan::Plan;
use crate::result::Values;
use crate::worker::StreamHandle;

/// Whether the CUDA driver and NVRTC libraries can be loaded.
pub fn libraries_present() -> bool {
    // SAFETY: these only try to dlopen the libraries and drop the handles.
    unsafe { cudarc::driver::sys::is_culib_present() && cudarc::nvrtc::sys::is_culib_present() }
}

/// A device worker's engine: the device's primary context.
pub struct DeviceEngine {
    context: Arc<CudaContext>,
}

impl DeviceEngine {
    /// The engine of device `ordinal`, on its primary context.
    pub fn new(ordinal: u32) -> Result<DeviceEngine> {
        if !libraries_present() {
            return Err(err!(
                Device,
                "device {ordinal}: the CUDA driver (libcuda) or NVRTC (libnvrtc) cannot be loaded on this machine"
            ));
        }
        let count =
            CudaContext::device_count().map_err(|e| err!(Device, "device {ordinal}: cuDeviceGetCount failed: {e}"))?;
        if ordinal as i64 >= count as i64 {
            return Err(err!(
                Device,
                "device {ordinal} is not below the {count} CUDA devices present"
            ));
        }
        let context = CudaContext::new(ordinal as usize)
            .map_err(|e| err!(Device, "device {ordinal}: retaining the primary context failed: {e}"))?;
        Ok(DeviceEngine { context })
    }

    /// Uploads every group's layer descriptors after a registration.
    pub fn upload_layout(&mut self, _layout: &Layout) -> Result<()> {
        let _ = &self.context;
        Ok(())
    }

    /// Queues the plan's checksums on `stream`.
    pub fn compute(&self, _layout: &Layout, _plan: &Plan, _role: Role, _stream: StreamHandle) -> Result<Values> {
        Err(err!(Unsupported, "the device engine is not implemented yet"))
    }
}
