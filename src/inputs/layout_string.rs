//! A layer's geometry from a strided tensor and a layout string such as
//! "KBTHD" (SPEC section 14): the one place that says which letters exist,
//! what each axis becomes in a [`Segment`], and which tensors are refused.
//!
//! The letters, outermost dimension first, case-insensitive:
//! - `B`: blocks (kernel blocks when `kernel_blocks` > 1);
//! - `T`: tokens of a (kernel) block;
//! - `H`: heads (absent for a cache with one head, such as MLA's);
//! - `D`: the elements of one head's cell for one token, contiguous;
//! - `K` (optional): size 2, K then V, each becoming a segment of its own.
//!
//! "NHD" means "BTHD" and "HND" means "BHTD". K and V in two tensors of the
//! same layout (without `K`) give one segment each.

use crate::base::error::{err, Result};
use crate::inputs::layout::{check_cells_disjoint, CellCounts, CellNames, Segment};

/// A strided tensor as a caller describes it: sizes and byte strides,
/// outermost dimension first, of elements of `element_size` bytes.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    /// Address of the element whose every index is 0.
    pub address: u64,
    /// Size of each dimension.
    pub shape: &'a [i64],
    /// Bytes between consecutive indices of each dimension (any sign).
    pub strides: &'a [i64],
    /// Bytes per element.
    pub element_size: u32,
}

/// What a layout string fixes of a layer: everything in a `kvcs_layer`
/// except who the layer is (group, layer number, heads' global numbers,
/// replicas, identity), which the caller says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerGeometry {
    /// Size of `H` (1 without it).
    pub num_heads: u32,
    /// Logical blocks: size of `B` over `kernel_blocks`.
    pub num_blocks: u32,
    /// Kernel blocks per logical block, as given.
    pub kernel_blocks: u32,
    /// Size of `T`.
    pub tokens_per_kernel_block: u32,
    /// One segment, or two (K then V).
    pub segments: Vec<Segment>,
}

/// One axis a layout letter names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Axis {
    Block,
    Token,
    Head,
    Dim,
    KeyValue,
}

impl Axis {
    fn of(letter: char) -> Option<Axis> {
        match letter.to_ascii_uppercase() {
            'B' => Some(Axis::Block),
            'T' => Some(Axis::Token),
            'H' => Some(Axis::Head),
            'D' => Some(Axis::Dim),
            'K' => Some(Axis::KeyValue),
            _ => None,
        }
    }

    fn letter(self) -> char {
        match self {
            Axis::Block => 'B',
            Axis::Token => 'T',
            Axis::Head => 'H',
            Axis::Dim => 'D',
            Axis::KeyValue => 'K',
        }
    }
}

/// The axes of `layout`, outermost first: aliases expanded, each letter
/// known and named once, B, T and D present.
fn parse(layout: &str) -> Result<Vec<Axis>> {
    let expanded = match layout.to_ascii_uppercase().as_str() {
        "NHD" => "BTHD",
        "HND" => "BHTD",
        _ => layout,
    };
    let refuse = || {
        err!(
            InvalidArgument,
            "layout \"{layout}\": name each dimension once with B, T, H, D and optionally K \
             (or NHD, HND), outermost first"
        )
    };
    let mut axes = Vec::with_capacity(5);
    for letter in expanded.chars() {
        let axis = Axis::of(letter).ok_or_else(refuse)?;
        if axes.contains(&axis) {
            return Err(refuse());
        }
        axes.push(axis);
    }
    if ![Axis::Block, Axis::Token, Axis::Dim].iter().all(|a| axes.contains(a)) {
        return Err(refuse());
    }
    Ok(axes)
}

/// One tensor's sizes and strides by axis.
struct Axes {
    size: [u64; 5],
    stride: [i64; 5],
}

impl Axes {
    fn size(&self, axis: Axis) -> u64 {
        self.size[axis as usize]
    }

    fn stride(&self, axis: Axis) -> i64 {
        self.stride[axis as usize]
    }
}

/// `tensor`'s dimensions read as `axes` (`name` names the tensor in errors).
fn axes_of(layout: &str, axes: &[Axis], tensor: &TensorView, name: &str) -> Result<Axes> {
    if tensor.shape.len() != axes.len() || tensor.strides.len() != axes.len() {
        return Err(err!(
            InvalidArgument,
            "layout \"{layout}\" names {} dimensions, {name} has {} (shape {:?})",
            axes.len(),
            tensor.shape.len(),
            tensor.shape
        ));
    }
    if tensor.element_size == 0 {
        return Err(err!(InvalidArgument, "{name}.element_size is 0"));
    }
    // Absent axes: size 1, stride 0 (one head, one K/V part).
    let mut found = Axes {
        size: [1; 5],
        stride: [0; 5],
    };
    for (i, (&axis, (&size, &stride))) in axes.iter().zip(tensor.shape.iter().zip(tensor.strides)).enumerate() {
        let size = u64::try_from(size).map_err(|_| {
            err!(
                InvalidArgument,
                "{name}.shape[{i}] ({}) is {size}, below 0",
                axis.letter()
            )
        })?;
        found.size[axis as usize] = size;
        found.stride[axis as usize] = stride;
    }
    let item = tensor.element_size as i64;
    if found.size(Axis::Dim) > 1 && found.stride(Axis::Dim) != item {
        return Err(err!(
            InvalidArgument,
            "{name}: the D dimension must be contiguous: its stride is {} bytes, element_size is {item}",
            found.stride(Axis::Dim)
        ));
    }
    if axes.contains(&Axis::KeyValue) && found.size(Axis::KeyValue) != 2 {
        return Err(err!(
            InvalidArgument,
            "{name}: the K dimension has size {}, not 2 (K then V)",
            found.size(Axis::KeyValue)
        ));
    }
    Ok(found)
}

/// `value` as a `u32` field named `what` of `name`.
fn field(value: impl Into<u128>, what: &str, name: &str) -> Result<u32> {
    let value = value.into();
    u32::try_from(value).map_err(|_| err!(InvalidArgument, "{name}: {what} is {value}, above {}", u32::MAX))
}

/// The segments of one tensor: one, or two where `K` splits it.
fn segments_of(axes: &Axes, tensor: &TensorView, kernel_blocks: u32, name: &str) -> Result<Vec<Segment>> {
    let block_stride = axes
        .stride(Axis::Block)
        .checked_mul(kernel_blocks as i64)
        .ok_or_else(|| {
            err!(
                InvalidArgument,
                "{name}: the B stride {} times kernel_blocks {kernel_blocks} overflows",
                axes.stride(Axis::Block)
            )
        })?;
    let bytes_per_token = axes.size(Axis::Dim) as u128 * tensor.element_size as u128;
    let bytes_per_token = field(bytes_per_token, "bytes_per_token (D size times element_size)", name)?;
    // One part without K, K then V with it (its size was checked to be 2).
    (0..axes.size(Axis::KeyValue) as i64)
        .map(|part| {
            let address = tensor
                .address
                .checked_add_signed(part * axes.stride(Axis::KeyValue))
                .ok_or_else(|| err!(InvalidArgument, "{name}: the V part's address overflows"))?;
            Ok(Segment {
                address,
                block_stride,
                kernel_block_stride: axes.stride(Axis::Block),
                head_stride: axes.stride(Axis::Head),
                token_stride: axes.stride(Axis::Token),
                bytes_per_token,
            })
        })
        .collect()
}

/// The geometry of one layer whose cache is `cache` (and `v`, where K and V
/// live in two tensors of the same layout) laid out as `layout`, with
/// `kernel_blocks` kernel blocks (consecutive along B) per logical block.
///
/// Checks what the layout string decides: the letters, the number of
/// dimensions, D contiguous, K of size 2, B a multiple of `kernel_blocks`,
/// `cache` and `v` agreeing in blocks, tokens and heads, every field
/// fitting its type, and distinct cells sharing no byte (registration's
/// rule, [`check_cells_disjoint`]). Registering the layer checks the rest
/// (alignment, bytes per token a whole number of the cell's 8- or 4-byte
/// pieces, every byte in a registered region).
pub fn layer_from_layout(
    layout: &str,
    cache: &TensorView,
    v: Option<&TensorView>,
    kernel_blocks: u32,
) -> Result<LayerGeometry> {
    let axes = parse(layout)?;
    if v.is_some() && axes.contains(&Axis::KeyValue) {
        return Err(err!(
            InvalidArgument,
            "layout \"{layout}\" has a K dimension and v is given too: give one or the other"
        ));
    }
    if kernel_blocks == 0 {
        return Err(err!(InvalidArgument, "kernel_blocks is 0; it must be at least 1"));
    }
    let cache_axes = axes_of(layout, &axes, cache, "cache")?;
    let blocks = cache_axes.size(Axis::Block);
    if blocks % kernel_blocks as u64 != 0 {
        return Err(err!(
            InvalidArgument,
            "cache: {blocks} blocks (B) are not a multiple of kernel_blocks {kernel_blocks}"
        ));
    }
    let mut segments = segments_of(&cache_axes, cache, kernel_blocks, "cache")?;
    if let Some(v) = v {
        let v_axes = axes_of(layout, &axes, v, "v")?;
        let agree = [Axis::Block, Axis::Token, Axis::Head];
        if agree.iter().any(|&a| v_axes.size(a) != cache_axes.size(a)) {
            let sizes = |x: &Axes| agree.map(|a| format!("{}={}", a.letter(), x.size(a))).join(" ");
            return Err(err!(
                InvalidArgument,
                "v and cache differ in blocks, tokens or heads: v {}, cache {}",
                sizes(&v_axes),
                sizes(&cache_axes)
            ));
        }
        segments.extend(segments_of(&v_axes, v, kernel_blocks, "v")?);
    }
    let geometry = LayerGeometry {
        num_heads: field(cache_axes.size(Axis::Head), "the H size (heads)", "cache")?,
        num_blocks: field(blocks / kernel_blocks as u64, "B over kernel_blocks (blocks)", "cache")?,
        kernel_blocks,
        tokens_per_kernel_block: field(cache_axes.size(Axis::Token), "the T size (tokens per block)", "cache")?,
        segments,
    };
    check_no_aliasing(layout, &geometry, v.is_some())?;
    Ok(geometry)
}

/// Fails when distinct cells of `geometry` share bytes (the layout's rule,
/// [`check_cells_disjoint`]): a dimension of stride 0 and size above 1, as
/// torch's `expand()` and numpy's `broadcast_to` make, or cells that
/// overlap. An empty tensor has no cells to alias (registering it fails).
fn check_no_aliasing(layout: &str, geometry: &LayerGeometry, two_tensors: bool) -> Result<()> {
    let counts = CellCounts {
        blocks: geometry.num_blocks,
        kernel_blocks: geometry.kernel_blocks,
        heads: geometry.num_heads,
        tokens: geometry.tokens_per_kernel_block,
    };
    let empty = [counts.blocks, counts.heads, counts.tokens].contains(&0)
        || geometry.segments.iter().any(|segment| segment.bytes_per_token == 0);
    if empty {
        return Ok(());
    }
    let names = CellNames {
        dims: [
            if geometry.kernel_blocks > 1 {
                "B x kernel_blocks"
            } else {
                "B"
            },
            "B",
            "H",
            "T",
        ],
        // K and V parts of one tensor, or one tensor each (or one cell).
        segments: if geometry.segments.len() == 2 && !two_tensors {
            ["K", "V"]
        } else {
            ["cache", "v"]
        },
    };
    check_cells_disjoint(&counts, &geometry.segments, &names)
        .map_err(|e| e.with_context(&format!("layout \"{layout}\"")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<'a>(shape: &'a [i64], strides: &'a [i64]) -> TensorView<'a> {
        TensorView {
            address: 4096,
            shape,
            strides,
            element_size: 2,
        }
    }

    #[test]
    fn aliases_and_letters() {
        assert_eq!(parse("nhd").unwrap(), parse("BTHD").unwrap());
        assert_eq!(parse("HND").unwrap(), parse("bhtd").unwrap());
        for bad in ["", "BTH", "BTHDD", "BTXD", "KBTHDK", "BTHDKX"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn flash_attention_splits_k_and_v() {
        // [2, 6 blocks, 16 tokens, 4 heads, 64 elements] of 2 bytes, contiguous.
        let shape = [2, 6, 16, 4, 64];
        let strides = [6 * 16 * 4 * 128, 16 * 4 * 128, 4 * 128, 128, 2];
        let geometry = layer_from_layout("KBTHD", &view(&shape, &strides), None, 2).unwrap();
        assert_eq!(
            (
                geometry.num_heads,
                geometry.num_blocks,
                geometry.tokens_per_kernel_block
            ),
            (4, 3, 16)
        );
        assert_eq!(geometry.segments.len(), 2);
        assert_eq!(geometry.segments[1].address, 4096 + strides[0] as u64);
        assert_eq!(geometry.segments[0].block_stride, 2 * strides[1]);
        assert_eq!(geometry.segments[0].kernel_block_stride, strides[1]);
        assert_eq!(geometry.segments[0].bytes_per_token, 128);
    }
}
