use thiserror::Error;

/// Represents an error when encoding/decoding raw byte buffers and frames
#[non_exhaustive]
#[derive(Error, Debug)]
pub enum CodecError {
    #[error("{0}")]
    Command(&'static str),
    #[error("{0}")]
    Greeting(&'static str),
    #[error("{0}")]
    Mechanism(&'static str),
    #[error("{0}")]
    Decode(&'static str),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Other(&'static str),
    /// A peer announced a frame, or a multipart message, larger than
    /// [`SocketOptions::max_message_size`](crate::SocketOptions::max_message_size).
    /// `size` is what the message would have reached with the announced frame.
    #[error("message of {size} bytes exceeds the maximum of {max} bytes")]
    MessageTooLarge { size: usize, max: usize },
}

pub(crate) type CodecResult<T> = Result<T, CodecError>;
