//! Framing: a 4-byte big-endian length, then that many bytes of JSON.
//!
//! A length prefix (rather than newline-delimited JSON) lets the reader
//! reject an oversized message before buffering it and makes a truncated
//! message detectable.

use std::io::{self, Read, Write};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Largest accepted message body. A network configuration with a
/// `prevResult` is a few kilobytes; this leaves ample room.
pub const MAX_FRAME_LEN: usize = 4 * 1024 * 1024;

/// Reading or writing a frame failed.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The peer closed the connection before a whole frame arrived.
    #[error("the connection closed before a complete message arrived")]
    Closed,
    /// The length prefix announces more than [`MAX_FRAME_LEN`].
    #[error("message of {len} bytes exceeds the {MAX_FRAME_LEN}-byte limit")]
    TooLarge {
        /// The announced length.
        len: usize,
    },
    /// The socket failed (including read/write timeouts).
    #[error("socket I/O failed: {0}")]
    Io(#[source] io::Error),
}

impl From<io::Error> for FrameError {
    fn from(error: io::Error) -> Self {
        if error.kind() == io::ErrorKind::UnexpectedEof {
            FrameError::Closed
        } else {
            FrameError::Io(error)
        }
    }
}

fn header(body: &[u8]) -> Result<[u8; 4], FrameError> {
    if body.len() > MAX_FRAME_LEN {
        return Err(FrameError::TooLarge { len: body.len() });
    }
    // MAX_FRAME_LEN fits in u32, so the cast cannot truncate.
    Ok((body.len() as u32).to_be_bytes())
}

fn body_len(header: [u8; 4]) -> Result<usize, FrameError> {
    let len = u32::from_be_bytes(header) as usize;
    if len > MAX_FRAME_LEN {
        return Err(FrameError::TooLarge { len });
    }
    Ok(len)
}

/// Writes one frame (blocking).
pub fn write_frame(writer: &mut impl Write, body: &[u8]) -> Result<(), FrameError> {
    writer.write_all(&header(body)?)?;
    writer.write_all(body)?;
    writer.flush()?;
    Ok(())
}

/// Reads one frame (blocking).
pub fn read_frame(reader: &mut impl Read) -> Result<Vec<u8>, FrameError> {
    let mut prefix = [0u8; 4];
    reader.read_exact(&mut prefix)?;
    let mut body = vec![0u8; body_len(prefix)?];
    reader.read_exact(&mut body)?;
    Ok(body)
}

/// Writes one frame (async).
pub async fn write_frame_async(
    writer: &mut (impl AsyncWrite + Unpin),
    body: &[u8],
) -> Result<(), FrameError> {
    writer.write_all(&header(body)?).await?;
    writer.write_all(body).await?;
    writer.flush().await?;
    Ok(())
}

/// Reads one frame (async).
pub async fn read_frame_async(
    reader: &mut (impl AsyncRead + Unpin),
) -> Result<Vec<u8>, FrameError> {
    let mut prefix = [0u8; 4];
    reader.read_exact(&mut prefix).await?;
    let mut body = vec![0u8; body_len(prefix)?];
    reader.read_exact(&mut body).await?;
    Ok(body)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn truncated_frames_are_closed_errors() {
        let mut encoded = Vec::new();
        write_frame(&mut encoded, b"hello").unwrap();
        for cut in 0..encoded.len() {
            let error = read_frame(&mut &encoded[..cut]).unwrap_err();
            assert!(matches!(error, FrameError::Closed), "cut at {cut}: {error}");
        }
    }

    #[test]
    fn oversized_length_is_rejected_before_reading_the_body() {
        let prefix = ((MAX_FRAME_LEN + 1) as u32).to_be_bytes();
        let error = read_frame(&mut &prefix[..]).unwrap_err();
        assert!(matches!(error, FrameError::TooLarge { .. }), "{error}");
    }

    #[tokio::test]
    async fn sync_writer_and_async_reader_agree() {
        let mut encoded = Vec::new();
        write_frame(&mut encoded, br#"{"a":1}"#).unwrap();
        let mut async_encoded = Vec::new();
        write_frame_async(&mut async_encoded, br#"{"a":1}"#)
            .await
            .unwrap();
        assert_eq!(encoded, async_encoded);
        assert_eq!(
            read_frame_async(&mut &encoded[..]).await.unwrap(),
            br#"{"a":1}"#
        );
    }

    proptest! {
        #[test]
        fn frames_round_trip(bodies in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 1..4)) {
            let mut stream = Vec::new();
            for body in &bodies {
                write_frame(&mut stream, body).unwrap();
            }
            let mut reader = &stream[..];
            for body in &bodies {
                prop_assert_eq!(&read_frame(&mut reader).unwrap(), body);
            }
            prop_assert!(reader.is_empty());
        }
    }
}
