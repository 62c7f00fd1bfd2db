//! `#[derive(Describe)]`: a config section's field reference generated from its struct, so the
//! reference a user reads (`dflash-host config explain`, `plugins doc`) is the struct the plugin
//! parses. What it reads:
//!
//! - each field's doc comment (required: the reference shows it), its name (serde's `rename`),
//!   its type (through `plugin_api::describe::ConfigType`), and its default: serde's
//!   `default = "path"`, `default` on the field or on the struct, `None` for an `Option`, else
//!   the field is required; `#[serde(skip)]` fields are left out;
//! - `#[describe(range = "...")]` says what the section's checks allow (`>= 1`, `in [0, 1)`);
//!   `#[describe(ty = "...")]` names the type of a field whose type has no `ConfigType`
//!   (a custom deserializer), its default then written from its `Debug`;
//! - on an enum of unit variants, the variants as serde spells them (`rename_all`, `rename`):
//!   the field's choices.

use proc_macro::TokenStream;
use proc_macro2::TokenStream as Tokens;
use quote::quote;
use syn::{parse_macro_input, Attribute, Data, DeriveInput, Expr, Fields, Lit, LitStr, Meta, Type};

#[proc_macro_derive(Describe, attributes(describe))]
pub fn derive_describe(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    let out = match &input.data {
        Data::Struct(s) => describe_struct(&input, &s.fields),
        Data::Enum(e) => describe_enum(&input, e),
        Data::Union(_) => Err(syn::Error::new_spanned(&input.ident, "Describe: a union is no config section")),
    };
    out.unwrap_or_else(syn::Error::into_compile_error).into()
}

/// The `key = value` and bare `key` items of `#[NAME(...)]` attributes.
#[derive(Default)]
struct Items {
    flags: Vec<String>,
    values: Vec<(String, Tokens, proc_macro2::Span)>,
}

impl Items {
    fn of(attrs: &[Attribute], name: &str) -> syn::Result<Self> {
        let mut items = Items::default();
        for attr in attrs.iter().filter(|a| a.path().is_ident(name)) {
            attr.parse_nested_meta(|meta| {
                let key = meta.path.get_ident().map(|i| i.to_string()).unwrap_or_default();
                if meta.input.peek(syn::Token![=]) {
                    let value: Expr = meta.value()?.parse()?;
                    items.values.push((
                        key,
                        quote!(#value),
                        meta.path.get_ident().map_or_else(proc_macro2::Span::call_site, |i| i.span()),
                    ));
                } else if meta.input.peek(syn::token::Paren) {
                    // `rename_all(serialize = ...)` and the like: not what a config reads.
                    let _ = meta.input.parse::<proc_macro2::Group>()?;
                } else {
                    items.flags.push(key);
                }
                Ok(())
            })?;
        }
        Ok(items)
    }

    fn flag(&self, key: &str) -> bool {
        self.flags.iter().any(|f| f == key)
    }

    /// A string value (`key = "text"`).
    fn string(&self, key: &str) -> syn::Result<Option<LitStr>> {
        match self.values.iter().find(|(k, _, _)| k == key) {
            None => Ok(None),
            Some((_, tokens, span)) => match syn::parse2::<Lit>(tokens.clone()) {
                Ok(Lit::Str(s)) => Ok(Some(s)),
                _ => Err(syn::Error::new(*span, format!("`{key}` takes a string"))),
            },
        }
    }
}

/// The doc comment's lines joined into one paragraph.
fn doc_of(attrs: &[Attribute]) -> String {
    let mut lines = Vec::new();
    for attr in attrs.iter().filter(|a| a.path().is_ident("doc")) {
        if let Meta::NameValue(nv) = &attr.meta {
            if let Expr::Lit(syn::ExprLit { lit: Lit::Str(s), .. }) = &nv.value {
                lines.push(s.value().trim().to_string());
            }
        }
    }
    lines.retain(|l| !l.is_empty());
    lines.join(" ")
}

fn is_option(ty: &Type) -> bool {
    matches!(ty, Type::Path(p) if p.qself.is_none() && p.path.segments.last().is_some_and(|s| s.ident == "Option"))
}

fn describe_struct(input: &DeriveInput, fields: &Fields) -> syn::Result<Tokens> {
    let name = &input.ident;
    let Fields::Named(fields) = fields else {
        return Err(syn::Error::new_spanned(name, "Describe: a config section has named fields"));
    };
    let container = Items::of(&input.attrs, "serde")?;
    let type_name = name.to_string();
    let mut field_docs = Vec::new();
    let mut nested = Vec::new();
    for field in &fields.named {
        let ident = field.ident.as_ref().expect("named field");
        let serde = Items::of(&field.attrs, "serde")?;
        if serde.flag("skip") || serde.flag("skip_deserializing") {
            continue;
        }
        if serde.flag("flatten") {
            return Err(syn::Error::new_spanned(
                ident,
                "Describe: `serde(flatten)` is not supported (it defeats deny_unknown_fields)",
            ));
        }
        let own = Items::of(&field.attrs, "describe")?;
        let key = serde
            .string("rename")?
            .map_or_else(|| ident.to_string().trim_start_matches("r#").to_string(), |s| s.value());
        let doc = doc_of(&field.attrs);
        if doc.is_empty() {
            return Err(syn::Error::new_spanned(
                ident,
                format!("Describe: field `{key}` has no doc comment; the config reference shows one for every field"),
            ));
        }
        let range = own.string("range")?.map_or(String::new(), |s| s.value());
        let ty = &field.ty;
        let written_ty = own.string("ty")?;
        let text = match &written_ty {
            Some(_) => quote!(::plugin_api::describe::debug_text),
            None => quote!(<#ty as ::plugin_api::describe::ConfigType>::toml_text),
        };
        let default_path = serde.values.iter().find(|(k, _, _)| k == "default").map(|(_, v, _)| v.clone());
        let default = if let Some(text_default) = own.string("default")? {
            quote!(::std::string::String::from(#text_default))
        } else if let Some(path) = default_path {
            let path: syn::ExprPath = syn::parse2::<LitStr>(path.clone())
                .and_then(|s| s.parse())
                .map_err(|_| syn::Error::new_spanned(&path, "serde `default` takes a function path in a string"))?;
            quote!(#text(&#path()))
        } else if serde.flag("default") {
            quote!(#text(&<#ty as ::std::default::Default>::default()))
        } else if container.flag("default") {
            quote!(#text(&<#name as ::std::default::Default>::default().#ident))
        } else if is_option(ty) {
            quote!(::std::string::String::from("-"))
        } else {
            quote!(::std::string::String::from("required"))
        };
        let toml_type = match &written_ty {
            Some(t) => quote!(::std::string::String::from(#t)),
            None => quote!(<#ty as ::plugin_api::describe::ConfigType>::toml_type()),
        };
        field_docs.push(quote! {
            ::plugin_api::describe::FieldDoc::new(#key, #toml_type, #default, #range, #doc)
        });
        if written_ty.is_none() {
            nested.push(quote! { tables.extend(<#ty as ::plugin_api::describe::ConfigType>::tables_under(#key)); });
        }
    }
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    Ok(quote! {
        impl #impl_generics ::plugin_api::describe::Describe for #name #ty_generics #where_clause {
            fn type_name() -> &'static str {
                #type_name
            }
            fn fields() -> ::std::vec::Vec<::plugin_api::describe::FieldDoc> {
                ::std::vec![#(#field_docs),*]
            }
            fn nested_tables() -> ::std::vec::Vec<::plugin_api::describe::TableDoc> {
                let mut tables = ::std::vec::Vec::new();
                #(#nested)*
                tables
            }
        }
        impl #impl_generics ::plugin_api::describe::ConfigType for #name #ty_generics #where_clause {
            fn toml_type() -> ::std::string::String {
                ::std::string::String::from("table")
            }
            fn toml_text(&self) -> ::std::string::String {
                ::std::string::String::from("see below")
            }
            fn tables_under(key: &str) -> ::std::vec::Vec<::plugin_api::describe::TableDoc> {
                ::plugin_api::describe::tables_of::<Self>(key)
            }
        }
    })
}

/// serde's `rename_all` applied to a variant name.
fn renamed(variant: &str, rule: Option<&str>) -> syn::Result<String> {
    let snake = || {
        let mut s = String::new();
        for (i, c) in variant.chars().enumerate() {
            if c.is_uppercase() && i > 0 {
                s.push('_');
            }
            s.extend(c.to_lowercase());
        }
        s
    };
    Ok(match rule {
        None => variant.to_string(),
        Some("lowercase") => variant.to_lowercase(),
        Some("UPPERCASE") => variant.to_uppercase(),
        Some("snake_case") => snake(),
        Some("SCREAMING_SNAKE_CASE") => snake().to_uppercase(),
        Some("kebab-case") => snake().replace('_', "-"),
        Some(other) => {
            return Err(syn::Error::new(
                proc_macro2::Span::call_site(),
                format!("Describe: serde rename_all = \"{other}\" is not supported"),
            ))
        }
    })
}

fn describe_enum(input: &DeriveInput, e: &syn::DataEnum) -> syn::Result<Tokens> {
    let name = &input.ident;
    let container = Items::of(&input.attrs, "serde")?;
    let rule = container.string("rename_all")?.map(|s| s.value());
    let mut choices = Vec::new();
    let mut arms = Vec::new();
    for v in &e.variants {
        if !matches!(v.fields, Fields::Unit) {
            return Err(syn::Error::new_spanned(
                &v.ident,
                "Describe: only unit variants are choices; give the field `#[describe(ty = \"...\")]` instead",
            ));
        }
        let serde = Items::of(&v.attrs, "serde")?;
        if serde.flag("skip") || serde.flag("skip_deserializing") {
            continue;
        }
        let spelled = match serde.string("rename")? {
            Some(s) => s.value(),
            None => renamed(&v.ident.to_string(), rule.as_deref())?,
        };
        let ident = &v.ident;
        let quoted = format!("\"{spelled}\"");
        arms.push(quote!(#name::#ident => ::std::string::String::from(#quoted)));
        choices.push(quoted);
        // Other spellings serde accepts are choices too.
        for (key, alias, _) in &serde.values {
            if key == "alias" {
                if let Ok(Lit::Str(a)) = syn::parse2::<Lit>(alias.clone()) {
                    choices.push(format!("\"{}\"", a.value()));
                }
            }
        }
    }
    let all = choices.join(" | ");
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    Ok(quote! {
        impl #impl_generics ::plugin_api::describe::ConfigType for #name #ty_generics #where_clause {
            fn toml_type() -> ::std::string::String {
                ::std::string::String::from(#all)
            }
            #[allow(unreachable_patterns)]
            fn toml_text(&self) -> ::std::string::String {
                match self {
                    #(#arms,)*
                    _ => ::std::string::String::from("-"),
                }
            }
        }
    })
}
