//! The gateway's stream encoders (being made): their tests through the routes.

#[cfg(test)]
mod tests;
