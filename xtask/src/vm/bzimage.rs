//! Extracting the uncompressed `vmlinux` from a bzImage.
//!
//! Under TCG, qemu boots the ELF `vmlinux` through its PVH entry point about
//! twice as fast as the bzImage, which first decompresses itself in emulation.
//! This follows the x86 boot protocol (Documentation/arch/x86/boot.rst) rather
//! than scanning for compression magic as the kernel's `extract-vmlinux` does.

use std::io::Write;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail, ensure};

/// Header offsets of the x86 boot protocol.
const SETUP_SECTS: usize = 0x1f1;
const HEADER_MAGIC: usize = 0x202;
const PROTOCOL_VERSION: usize = 0x206;
const PAYLOAD_OFFSET: usize = 0x248;
const PAYLOAD_LENGTH: usize = 0x24c;
/// `payload_offset`/`payload_length` exist from boot protocol 2.08 on.
const MIN_PROTOCOL: u16 = 0x0208;

const XZ_MAGIC: &[u8] = &[0xfd, b'7', b'z', b'X', b'Z', 0];
const ELF_MAGIC: &[u8] = b"\x7fELF";

/// The compressed kernel inside a bzImage.
fn payload(bzimage: &[u8]) -> Result<&[u8]> {
    ensure!(
        bzimage.len() > PAYLOAD_LENGTH + 4,
        "too short for a bzImage"
    );
    ensure!(
        &bzimage[HEADER_MAGIC..HEADER_MAGIC + 4] == b"HdrS",
        "no x86 boot header (HdrS)"
    );
    let u16_at = |at: usize| u16::from_le_bytes([bzimage[at], bzimage[at + 1]]);
    let u32_at =
        |at: usize| u32::from_le_bytes(bzimage[at..at + 4].try_into().expect("4 bytes")) as usize;
    let protocol = u16_at(PROTOCOL_VERSION);
    ensure!(
        protocol >= MIN_PROTOCOL,
        "boot protocol {protocol:#x} predates payload fields"
    );
    // A setup_sects of 0 means 4, for compatibility with ancient kernels.
    let setup_sects = match bzimage[SETUP_SECTS] {
        0 => 4,
        n => usize::from(n),
    };
    let start = (setup_sects + 1) * 512 + u32_at(PAYLOAD_OFFSET);
    let end = start + u32_at(PAYLOAD_LENGTH);
    bzimage
        .get(start..end)
        .context("payload lies outside the bzImage")
}

/// Decompresses the ELF kernel out of a bzImage.
///
/// Only xz payloads (Debian's choice) are handled; the caller boots the bzImage
/// itself when this fails.
pub fn extract_vmlinux(bzimage: &[u8]) -> Result<Vec<u8>> {
    let payload = payload(bzimage)?;
    if !payload.starts_with(XZ_MAGIC) {
        bail!("the payload is not xz-compressed");
    }
    // The kernel appends the uncompressed size after the xz stream;
    // --single-stream makes xz ignore it.
    let vmlinux = pipe_through(Command::new("xz").args(["-dc", "--single-stream"]), payload)?;
    ensure!(
        vmlinux.starts_with(ELF_MAGIC),
        "the decompressed payload is not an ELF file"
    );
    Ok(vmlinux)
}

/// Feeds `input` to a command's stdin and returns its stdout.
fn pipe_through(command: &mut Command, input: &[u8]) -> Result<Vec<u8>> {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {command:?}"))?;
    let mut stdin = child.stdin.take().expect("stdin is piped");
    // Write from a thread: the child fills its stdout pipe while we write.
    let (written, output) = std::thread::scope(|scope| {
        let writer = scope.spawn(move || stdin.write_all(input));
        let output = child.wait_with_output();
        (writer.join(), output)
    });
    let output = output.with_context(|| format!("cannot wait for {command:?}"))?;
    if !output.status.success() {
        bail!(
            "{command:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    written
        .map_err(|_| anyhow::anyhow!("writing to {command:?} panicked"))?
        .with_context(|| format!("cannot write to {command:?}"))?;
    Ok(output.stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal bzImage header with the payload placed after `setup_sects`.
    fn fake_bzimage(setup_sects: u8, payload_bytes: &[u8]) -> Vec<u8> {
        let sects = if setup_sects == 0 {
            4
        } else {
            usize::from(setup_sects)
        };
        let start = (sects + 1) * 512;
        let mut image = vec![0u8; start];
        image[SETUP_SECTS] = setup_sects;
        image[HEADER_MAGIC..HEADER_MAGIC + 4].copy_from_slice(b"HdrS");
        image[PROTOCOL_VERSION..PROTOCOL_VERSION + 2].copy_from_slice(&0x020fu16.to_le_bytes());
        image[PAYLOAD_OFFSET..PAYLOAD_OFFSET + 4].copy_from_slice(&16u32.to_le_bytes());
        let length = u32::try_from(payload_bytes.len()).unwrap();
        image[PAYLOAD_LENGTH..PAYLOAD_LENGTH + 4].copy_from_slice(&length.to_le_bytes());
        image.extend_from_slice(&[0xaa; 16]);
        image.extend_from_slice(payload_bytes);
        image.extend_from_slice(&[0xbb; 8]);
        image
    }

    #[test]
    fn payload_is_found_after_the_setup_sectors() {
        assert_eq!(payload(&fake_bzimage(27, b"kernel")).unwrap(), b"kernel");
    }

    #[test]
    fn zero_setup_sectors_means_four() {
        assert_eq!(payload(&fake_bzimage(0, b"old")).unwrap(), b"old");
    }

    #[test]
    fn a_file_without_boot_header_is_rejected() {
        let mut image = fake_bzimage(4, b"x");
        image[HEADER_MAGIC] = b'X';
        assert!(payload(&image).is_err());
    }

    #[test]
    fn a_payload_past_the_end_is_rejected() {
        let mut image = fake_bzimage(4, b"payload");
        image.truncate(image.len() - 12);
        assert!(payload(&image).is_err());
    }

    #[test]
    fn non_xz_payloads_are_refused() {
        let error = extract_vmlinux(&fake_bzimage(4, b"\x1f\x8bgzip")).unwrap_err();
        assert!(error.to_string().contains("not xz"), "{error}");
    }
}
