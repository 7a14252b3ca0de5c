//! Writing initramfs archives in the cpio "newc" format the kernel unpacks.

use std::io::{self, Write};

/// File type bits of `st_mode`.
const S_IFDIR: u32 = 0o040_000;
const S_IFREG: u32 = 0o100_000;
const S_IFLNK: u32 = 0o120_000;
const S_IFCHR: u32 = 0o020_000;

/// Streams entries into a newc archive; call [`CpioWriter::finish`] at the end.
pub struct CpioWriter<W: Write> {
    out: W,
    written: u64,
    next_inode: u32,
}

impl<W: Write> CpioWriter<W> {
    pub fn new(out: W) -> Self {
        Self {
            out,
            written: 0,
            next_inode: 1,
        }
    }

    /// A directory; `path` is relative to the archive root, e.g. `usr/lib`.
    pub fn dir(&mut self, path: &str) -> io::Result<()> {
        self.entry(path, S_IFDIR | 0o755, (0, 0), &[])
    }

    /// A regular file with permission bits `mode`.
    pub fn file(&mut self, path: &str, mode: u32, data: &[u8]) -> io::Result<()> {
        self.entry(path, S_IFREG | (mode & 0o7777), (0, 0), data)
    }

    pub fn symlink(&mut self, path: &str, target: &str) -> io::Result<()> {
        self.entry(path, S_IFLNK | 0o777, (0, 0), target.as_bytes())
    }

    /// A character device node, e.g. `dev/console` (5, 1), which the kernel
    /// needs before `/init` runs to give it a console.
    pub fn char_device(&mut self, path: &str, major: u32, minor: u32) -> io::Result<()> {
        self.entry(path, S_IFCHR | 0o600, (major, minor), &[])
    }

    /// Writes the trailer and returns the output.
    pub fn finish(mut self) -> io::Result<W> {
        self.next_inode = 0;
        self.entry("TRAILER!!!", 0, (0, 0), &[])?;
        Ok(self.out)
    }

    fn entry(&mut self, path: &str, mode: u32, rdev: (u32, u32), data: &[u8]) -> io::Result<()> {
        let name_size = path.len() + 1; // with its NUL
        let inode = self.next_inode;
        self.next_inode = self.next_inode.wrapping_add(1);
        let nlink = if mode & S_IFDIR == S_IFDIR { 2 } else { 1 };
        let fields = [
            inode,
            mode,
            0, // uid: root
            0, // gid: root
            nlink,
            0, // mtime: fixed, so equal inputs give equal archives
            to_u32(data.len())?,
            0, // devmajor
            0, // devminor
            rdev.0,
            rdev.1,
            to_u32(name_size)?,
            0, // check: unused in newc
        ];
        let mut header = String::from("070701");
        for field in fields {
            header.push_str(&format!("{field:08x}"));
        }
        self.write(header.as_bytes())?;
        self.write(path.as_bytes())?;
        self.write(&[0])?;
        self.pad()?;
        self.write(data)?;
        self.pad()
    }

    fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Header+name and data are each padded to a multiple of four bytes.
    fn pad(&mut self) -> io::Result<()> {
        let padding = (4 - (self.written % 4) as usize) % 4;
        self.write(&[0; 3][..padding])
    }
}

fn to_u32(size: usize) -> io::Result<u32> {
    u32::try_from(size).map_err(|_| io::Error::other("cpio entries are limited to 4 GiB"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses a newc archive back into (name, mode, data) triples.
    fn parse(mut archive: &[u8]) -> Vec<(String, u32, Vec<u8>)> {
        let mut entries = Vec::new();
        let mut offset = 0usize;
        loop {
            assert_eq!(&archive[..6], b"070701", "bad magic at offset {offset}");
            let field = |i: usize| {
                let text = std::str::from_utf8(&archive[6 + i * 8..14 + i * 8]).unwrap();
                u32::from_str_radix(text, 16).unwrap() as usize
            };
            let (mode, size, name_size) = (field(1) as u32, field(6), field(11));
            let name_end = 110 + name_size;
            let name = String::from_utf8(archive[110..name_end - 1].to_vec()).unwrap();
            let data_start = name_end.div_ceil(4) * 4;
            let data = archive[data_start..data_start + size].to_vec();
            let next = (data_start + size).div_ceil(4) * 4;
            offset += next;
            archive = &archive[next..];
            if name == "TRAILER!!!" {
                assert!(archive.is_empty());
                return entries;
            }
            entries.push((name, mode, data));
        }
    }

    #[test]
    fn entries_round_trip_with_alignment() {
        let mut writer = CpioWriter::new(Vec::new());
        writer.dir("bin").unwrap();
        writer.file("bin/busybox", 0o755, b"odd length").unwrap();
        writer.symlink("bin/sh", "busybox").unwrap();
        writer.char_device("dev/console", 5, 1).unwrap();
        writer.file("init", 0o755, b"#!/bin/sh\n").unwrap();
        let archive = writer.finish().unwrap();
        assert_eq!(archive.len() % 4, 0);

        let entries = parse(&archive);
        let names: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(
            names,
            ["bin", "bin/busybox", "bin/sh", "dev/console", "init"]
        );
        assert_eq!(entries[0].1, S_IFDIR | 0o755);
        assert_eq!(
            entries[1],
            (
                "bin/busybox".into(),
                S_IFREG | 0o755,
                b"odd length".to_vec()
            )
        );
        assert_eq!(entries[2].2, b"busybox");
        assert_eq!(entries[3].1, S_IFCHR | 0o600);
    }
}
